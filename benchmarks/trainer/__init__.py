"""This package's trainer step: against TRL's, and with decoupled rollouts."""
