"""Training data: layouts on disk, image transforms and the batch order."""
