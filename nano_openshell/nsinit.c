/* pid 1 of a namespaced Sandbox: starts, reaps and kills its commands (nsinit.py does the same job in
Python, where no C compiler works; tests/nano_openshell/test_init.py runs on both). init_build.py
compiles it once per machine, cached by the source's hash: it starts in well under a millisecond,
where Python's own start-up is several.

Started as `bwrap ... --as-pid-1 -- /proc/self/fd/BIN CTL BIN`: BIN is this program's file, opened by
the supervisor (the sandbox cannot see the cache it lives in), CTL the SOCK_SEQPACKET socket.
Messages (launcher.encode builds them):
  'r' u64 id, u32 argc, u32 envc, argc + envc NUL-terminated strings  + SCM_RIGHTS [status, out, err(, script)]
      start a command in its own session, stdin /dev/null, cwd /workspace, a fresh private TMPDIR in
      /tmp (removed once it is reported, for a bounded time), a script memfd as its fd 3
  'k' u64 id: kill that command's whole tree
  'p' + SCM_RIGHTS [status]: answered "R\n"
Status lines: "D<code> <ns>\n" as soon as the command's main process is reaped (its code, and
CLOCK_MONOTONIC then: a deadline passing while what it left is killed is not its own), "X<code>\n"
once the command and all it started are gone (128+N for a signal N, -9 when killed on request),
"E<why>\n" when it could not start. EOF on CTL: the supervisor is gone; the init exits and the kernel
kills the rest of the pid namespace. As pid 1 it reaps every orphan and no process of the sandbox
can signal it. When a command's main process exits, what no running command owns is killed: with
none running, everything but the init (kill(-1)); else every process outside the running commands'
trees, so a daemon that left its command's tree dies then. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_MESSAGE (1 << 20)       /* argv + env of one command; larger scripts come as a file descriptor */
#define MAX_FDS 4
#define REMOVE_BUDGET_NS 200000000  /* removing finished commands' TMPDIRs: 0.2 s at a time */
#define MAX_REMOVE_DEPTH 64         /* deeper directories stay in /tmp until the Sandbox closes */

struct command { pid_t pid; uint64_t id; int status_fd, killed, exit_status; char tmp[80]; };

static struct command *running;     /* commands whose main process has not been reaped */
static size_t n_running, cap_running;
static int ctl, devnull, sig_fd;
static char tmp_prefix[32];
static sigset_t every_signal, no_signal;
static char *message;

static void write_line(int fd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void write_line(int fd, const char *fmt, ...) {
    char line[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line - 1, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if (n > (int)sizeof line - 2) n = sizeof line - 2;
    line[n++] = '\n';
    (void)!write(fd, line, n);  /* the supervisor may have given up on this command: nothing to do */
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* ---- processes of the namespace (its own /proc) -------------------------------------------- */

struct procs { pid_t *pid, *ppid; char *state; size_t n; };

static void read_procs(struct procs *p) {
    size_t cap = 256;
    p->n = 0;
    p->pid = malloc(cap * sizeof *p->pid), p->ppid = malloc(cap * sizeof *p->ppid), p->state = malloc(cap);
    DIR *d = opendir("/proc");
    if (!d || !p->pid || !p->ppid || !p->state) { if (d) closedir(d); return; }
    struct dirent *e;
    while ((e = readdir(d))) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        if (*end || pid <= 1) continue;
        char path[64], buf[512];
        snprintf(path, sizeof path, "/proc/%ld/stat", pid);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        ssize_t n = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (n <= 0) continue;
        buf[n] = 0;
        char *paren = strrchr(buf, ')');  /* comm may hold spaces and ')' */
        char state;
        long ppid;
        if (!paren || sscanf(paren + 1, " %c %ld", &state, &ppid) != 2) continue;
        if (p->n == cap) {
            cap *= 2;
            pid_t *a = realloc(p->pid, cap * sizeof *a), *b = realloc(p->ppid, cap * sizeof *b);
            char *c = realloc(p->state, cap);
            if (a) p->pid = a;
            if (b) p->ppid = b;
            if (c) p->state = c;
            if (!a || !b || !c) break;
        }
        p->pid[p->n] = pid, p->ppid[p->n] = ppid, p->state[p->n] = state, p->n++;
    }
    closedir(d);
}

static void free_procs(struct procs *p) { free(p->pid), free(p->ppid), free(p->state); }

static int is_root(pid_t pid, const pid_t *roots, size_t n_roots) {
    for (size_t i = 0; i < n_roots; i++)
        if (roots[i] == pid) return 1;
    return 0;
}

static const struct procs *sorting;
static int by_pid(const void *a, const void *b) {
    pid_t x = sorting->pid[*(const size_t *)a], y = sorting->pid[*(const size_t *)b];
    return (x > y) - (x < y);
}

/* the index of pid in p (order: p's indices sorted by pid), or p->n when it is not there */
static size_t find(const struct procs *p, const size_t *order, pid_t pid) {
    size_t lo = 0, hi = p->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (p->pid[order[mid]] < pid) lo = mid + 1;
        else hi = mid;
    }
    return lo < p->n && p->pid[order[lo]] == pid ? order[lo] : p->n;
}

/* keep[i] = 1 when process i is one of roots or descends from one (2: it does not); each process's
   parent chain is walked once, with what earlier walks found remembered (O(n log n) for any shape) */
static char *in_trees(const struct procs *p, const pid_t *roots, size_t n_roots) {
    char *keep = calloc(p->n ? p->n : 1, 1);  /* 0 unknown, 1 inside, 2 outside */
    size_t *path = malloc((p->n + 1) * sizeof *path), *order = malloc((p->n + 1) * sizeof *order);
    if (!keep || !path || !order) { free(keep), free(path), free(order); return NULL; }
    for (size_t i = 0; i < p->n; i++) order[i] = i;
    sorting = p;
    qsort(order, p->n, sizeof *order, by_pid);
    for (size_t i = 0; i < p->n; i++) {
        size_t depth = 0, j = i;
        char verdict = 2;
        for (;;) {
            if (keep[j]) { verdict = keep[j]; break; }
            path[depth++] = j;
            if (is_root(p->pid[j], roots, n_roots)) { verdict = 1; break; }
            j = find(p, order, p->ppid[j]);
            if (j == p->n || depth > p->n) break;  /* parent is pid 1 (us) or gone: outside every tree */
        }
        for (size_t m = 0; m < depth; m++) keep[path[m]] = verdict;
    }
    free(path), free(order);
    return keep;
}

static void kill_all(void) { kill(-1, SIGKILL); }  /* as pid 1: every other process of the namespace */

static void reap_all(void) { while (waitpid(-1, NULL, 0) > 0 || errno == EINTR) {} }

/* every process in the trees of roots (keep_them = 0), or every one outside them (keep_them = 1);
   returns how many were sent SIGKILL */
static size_t kill_trees(const pid_t *roots, size_t n_roots, int keep_them) {
    struct procs p;
    read_procs(&p);
    char *keep = in_trees(&p, roots, n_roots);
    size_t killed = 0;
    for (size_t i = 0; keep && i < p.n; i++) {
        int inside = keep[i] == 1;
        if (inside != keep_them && p.state[i] != 'Z') { kill(p.pid[i], SIGKILL); killed++; }
    }
    free(keep);
    free_procs(&p);
    return killed;
}

/* are all our direct children running commands (so no orphan lives anywhere)? -1: unknown */
static int only_commands_are_children(void) {
    int fd = open("/proc/1/task/1/children", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    char buf[65536];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n < 0 || n == sizeof buf - 1) return -1;
    buf[n] = 0;
    for (char *s = buf, *end; *s; s = end) {
        long pid = strtol(s, &end, 10);
        if (end == s) break;
        int ours = 0;
        for (size_t i = 0; i < n_running; i++) ours |= running[i].pid == pid;
        if (!ours) return 0;
    }
    return 1;
}

/* ---- TMPDIRs -------------------------------------------------------------------------------- */

static void empty_dir(int fd, int64_t deadline, int depth) {
    fchmod(fd, 0700);
    DIR *d = fdopendir(fd);
    if (!d) { close(fd); return; }
    struct dirent *e;
    while ((e = readdir(d)) && now_ns() < deadline) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        if (unlinkat(dirfd(d), e->d_name, 0) == 0) continue;
        if (errno != EISDIR && errno != EPERM) continue;
        if (depth >= MAX_REMOVE_DEPTH) continue;
        int sub = openat(dirfd(d), e->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (sub < 0) continue;
        empty_dir(sub, deadline, depth + 1);
        unlinkat(dirfd(d), e->d_name, AT_REMOVEDIR);
    }
    closedir(d);
}

/* rm -rf without following links (the command owned it: it may hold links and 0500 dirs) */
static void remove_tree(const char *path, int64_t deadline) {
    if (rmdir(path) == 0 || errno == ENOENT) return;  /* the usual case: nothing was left there */
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) { unlink(path); return; }
    empty_dir(fd, deadline, 0);
    rmdir(path);
}

/* a new private directory in /tmp for one command; "" if /tmp cannot take one (the command then
   gets /tmp itself rather than not running). A name another command made first is passed over. */
static void fresh_dir(uint64_t id, char *out, size_t size) {
    for (int attempt = 0; attempt < 3; attempt++) {
        uint32_t salt = 0;
        if (attempt) (void)!getrandom(&salt, sizeof salt, 0);
        if (attempt) snprintf(out, size, "%s%llu-%08x", tmp_prefix, (unsigned long long)id, salt);
        else snprintf(out, size, "%s%llu", tmp_prefix, (unsigned long long)id);
        if (mkdir(out, 0700) == 0) return;
        if (errno != EEXIST) break;
    }
    out[0] = 0;
}

/* ---- messages ------------------------------------------------------------------------------- */

static void run(const char *msg, size_t len, const int *fds, int n_fds) {
    uint64_t id;
    uint32_t argc, envc;
    if (len < 17 || n_fds < 3) { if (n_fds) write_line(fds[0], "Ea malformed run message"); return; }
    memcpy(&id, msg + 1, 8), memcpy(&argc, msg + 9, 4), memcpy(&envc, msg + 13, 4);
    if (argc < 1 || argc > len || envc > len) { write_line(fds[0], "Ea malformed run message"); return; }
    char **argv = calloc(argc + 1, sizeof *argv), **envp = calloc(envc + 2, sizeof *envp);
    if (!argv || !envp) { free(argv), free(envp); write_line(fds[0], "Eout of memory"); return; }
    const char *s = msg + 17, *end = msg + len;
    size_t n_env = 0;
    for (uint32_t i = 0; i < argc + envc; i++) {
        const char *nul = memchr(s, 0, end - s);
        if (!nul) { free(argv), free(envp); write_line(fds[0], "Ea malformed run message"); return; }
        if (i < argc) argv[i] = (char *)s;
        else if (strncmp(s, "TMPDIR=", 7)) envp[n_env++] = (char *)s;  /* ours replaces the sender's */
        s = nul + 1;
    }
    struct command cmd = {.id = id, .status_fd = dup(fds[0]), .killed = 0};
    fcntl(cmd.status_fd, F_SETFD, FD_CLOEXEC);
    fresh_dir(id, cmd.tmp, sizeof cmd.tmp);
    char tmpdir[96];
    snprintf(tmpdir, sizeof tmpdir, "TMPDIR=%s", cmd.tmp[0] ? cmd.tmp : "/tmp");
    envp[n_env] = tmpdir;

    posix_spawn_file_actions_t actions;
    posix_spawnattr_t attr;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, devnull, 0);
    posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
    posix_spawn_file_actions_adddup2(&actions, fds[2], 2);
    if (n_fds > 3) posix_spawn_file_actions_adddup2(&actions, fds[3], 3);  /* a large script, read as /dev/fd/3 */
    posix_spawnattr_init(&attr);
    /* its own session (so its own process group); every signal at its default, none blocked */
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSID | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK);
    posix_spawnattr_setsigdefault(&attr, &every_signal);
    posix_spawnattr_setsigmask(&attr, &no_signal);
    int err = posix_spawn(&cmd.pid, argv[0], &actions, &attr, argv, envp);
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attr);
    free(argv), free(envp);
    if (err) {  /* this command cannot start; the init and the others go on */
        write_line(cmd.status_fd, "E%s: %s", strerror(err), msg + 17);
        close(cmd.status_fd);
        if (cmd.tmp[0]) remove_tree(cmd.tmp, now_ns() + REMOVE_BUDGET_NS);
        return;
    }
    if (n_running == cap_running) {
        size_t cap = cap_running ? 2 * cap_running : 16;
        struct command *more = realloc(running, cap * sizeof *more);
        if (!more) { kill(cmd.pid, SIGKILL); write_line(cmd.status_fd, "Eout of memory"); close(cmd.status_fd); return; }
        running = more, cap_running = cap;
    }
    running[n_running++] = cmd;
}

static void kill_command(uint64_t id) {
    for (size_t i = 0; i < n_running; i++) {
        if (running[i].id != id) continue;
        running[i].killed = 1;
        if (n_running == 1) kill_all();
        else kill_trees(&running[i].pid, 1, 0);
        return;
    }  /* not found: already reported */
}

static void handle(const char *msg, size_t len, const int *fds, int n_fds, int cut) {
    if (cut) { if (n_fds) write_line(fds[0], "Ea message cut short (its fds could not all be received)"); return; }
    if (msg[0] == 'r') run(msg, len, fds, n_fds);
    else if (msg[0] == 'k' && len == 9) { uint64_t id; memcpy(&id, msg + 1, 8); kill_command(id); }
    else if (msg[0] == 'p' && n_fds) write_line(fds[0], "R");
    else if (n_fds) write_line(fds[0], "Ean unknown message");
}

static void receive(void) {  /* every message waiting (one wakeup may bring several) */
    for (int flags = MSG_CMSG_CLOEXEC;; flags |= MSG_DONTWAIT) {
        union { char buf[CMSG_SPACE(sizeof(int) * MAX_FDS)]; struct cmsghdr align; } anc;
        struct iovec iov = {message, MAX_MESSAGE};
        struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = anc.buf, .msg_controllen = sizeof anc.buf};
        ssize_t n = recvmsg(ctl, &m, flags);
        if (n < 0) { if (errno == EINTR) continue; return; }
        if (n == 0) _exit(0);  /* the supervisor is gone: pid 1 exits, the kernel kills the rest */
        int fds[MAX_FDS], n_fds = 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
            size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t i = 0; i < count; i++) {
                int fd;
                memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
                if (n_fds < MAX_FDS) fds[n_fds++] = fd;
                else close(fd);
            }
        }
        handle(message, n, fds, n_fds, (m.msg_flags & (MSG_CTRUNC | MSG_TRUNC)) != 0);
        for (int i = 0; i < n_fds; i++) close(fds[i]);
    }
}

/* ---- exits ---------------------------------------------------------------------------------- */

static int exit_code(const struct command *cmd) {  /* as bash reports it; -9 when killed on request */
    int s = cmd->exit_status;
    return cmd->killed ? -9 : WIFSIGNALED(s) ? 128 + WTERMSIG(s) : WEXITSTATUS(s);
}

/* reap every exited child without blocking; finished commands move to done[], each told at once
   that it ended (before what it left is killed: a deadline passing meanwhile is not its own).
   Returns whether any child is left. */
static int reap(struct command *done, size_t *n_done) {
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid < 0) { if (errno == EINTR) continue; return 0; }
        if (pid == 0) return 1;
        for (size_t i = 0; i < n_running; i++) {
            if (running[i].pid != pid) continue;
            running[i].exit_status = status;
            write_line(running[i].status_fd, "D%d %lld", exit_code(&running[i]), (long long)now_ns());
            done[(*n_done)++] = running[i];
            running[i] = running[--n_running];
            break;
        }
    }
}

/* once a command's main process exited, kill what no running command owns, then report it */
static void settle(void) {
    struct command *done = malloc((n_running + 1) * sizeof *done);
    if (!done) return;
    size_t n_done = 0;
    int others = reap(done, &n_done);
    if (!n_done) { free(done); return; }
    while (n_running && others) {  /* others still run: kill every process outside their trees */
        if (only_commands_are_children() == 1) break;  /* no orphan anywhere */
        pid_t *roots = malloc(n_running * sizeof *roots);
        if (!roots) break;
        for (size_t i = 0; i < n_running; i++) roots[i] = running[i].pid;
        size_t killed = kill_trees(roots, n_running, 1);
        free(roots);
        if (!killed) break;
        nanosleep(&(struct timespec){0, 500000}, NULL);  /* let the kills land before looking again */
        others = reap(done, &n_done);
    }
    if (!n_running && others) { kill_all(); reap_all(); }  /* nothing runs: everything but us goes */
    for (size_t i = 0; i < n_done; i++) {
        write_line(done[i].status_fd, "X%d", exit_code(&done[i]));
        close(done[i].status_fd);
    }
    /* after the reports: a TMPDIR full of files must not delay its command's result */
    int64_t deadline = now_ns() + REMOVE_BUDGET_NS;
    for (size_t i = 0; i < n_done; i++)
        if (done[i].tmp[0]) remove_tree(done[i].tmp, deadline);
    free(done);
}

int main(int argc, char **argv) {
    if (argc == 2 && !strcmp(argv[1], "--check")) return 0;  /* init_build.py: this file can be executed */
    if (argc < 2) { fprintf(stderr, "usage: nsinit CTL_FD [OWN_FD]\n"); return 2; }
    ctl = atoi(argv[1]);
    fcntl(ctl, F_SETFD, FD_CLOEXEC);
    if (argc > 2) close(atoi(argv[2]));  /* our own program's file: no command may inherit it */
    devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
    message = malloc(MAX_MESSAGE);
    uint32_t salt[2] = {0, 0};
    (void)!getrandom(salt, sizeof salt, 0);
    snprintf(tmp_prefix, sizeof tmp_prefix, "/tmp/.command-%08x-", salt[0]);
    /* SIGCHLD comes through a signalfd; commands start with every signal at its default (glibc's
       sigfillset leaves out its own two) and none blocked */
    sigfillset(&every_signal);
    sigdelset(&every_signal, SIGKILL), sigdelset(&every_signal, SIGSTOP);
    sigemptyset(&no_signal);
    sigset_t chld;
    sigemptyset(&chld), sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, NULL);
    signal(SIGPIPE, SIG_IGN);  /* a status pipe the supervisor closed is an EPIPE, not our death */
    sig_fd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    if (devnull < 0 || !message || sig_fd < 0) { perror("nsinit"); return 1; }
    struct pollfd fds[2] = {{ctl, POLLIN, 0}, {sig_fd, POLLIN, 0}};
    for (;;) {
        if (poll(fds, 2, -1) < 0) continue;
        if (fds[1].revents) {
            struct signalfd_siginfo info;
            while (read(sig_fd, &info, sizeof info) > 0) {}
            settle();
        }
        if (fds[0].revents) receive();
    }
}
