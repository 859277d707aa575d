"""Privacy on the server: what the sketches gave away, differentially private cluster models, secure sums."""
