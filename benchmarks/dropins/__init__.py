"""The drop-in losses inside other trainers' own steps (TRL, verl)."""
