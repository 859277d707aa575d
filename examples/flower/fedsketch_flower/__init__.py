"""FedSketch on Flower: the example app (server_app, client_app, and task, the data both read)."""
