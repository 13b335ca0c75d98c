"""Does a run learn as TRL's does: the same runs in both, over seeds, and what their draws share."""
