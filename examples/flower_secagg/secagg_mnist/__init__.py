"""secagg_mnist: a Flower app training the paper's 28x28 CNN on mnist5k with FedAvg under SecAgg+."""
