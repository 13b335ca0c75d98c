"""What a run trains on: the tasks and their examples (tasks), datasets read from files or the Hub (datasets), and the
reward functions that score completions (rewards, rewards_builtin)."""
