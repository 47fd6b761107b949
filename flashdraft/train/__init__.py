"""Training a draft: the loop, its config, data, loss and checkpoints, and regenerating training data with the target."""
