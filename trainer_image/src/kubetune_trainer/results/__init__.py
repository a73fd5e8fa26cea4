"""What a run leaves and what is made from it: validation samples and the best weights, generated
images, evaluation and its metrics, exported weights, the run report."""
