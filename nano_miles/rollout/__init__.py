"""Rollouts: the shell environment, multi-turn TITO episodes, the step's producer, dynamic sampling, guidance."""
