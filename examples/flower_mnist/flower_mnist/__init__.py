"""flower_mnist: a Flower app (Message API) training the paper's 28x28 CNN on mnist5k."""
