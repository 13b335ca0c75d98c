"""The group-size study: the invalid-group rate, gradients and learning against G."""
