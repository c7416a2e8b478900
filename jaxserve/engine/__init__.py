"""The engine: requests in, outputs out; replicas, input and output processing, remote replicas."""
