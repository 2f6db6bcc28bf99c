"""`cosine plan`: capacity planning by discrete-event simulation of a deployment, driving the scheduler's own code."""
