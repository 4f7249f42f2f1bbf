"""Where a stored conversation's KV lives and in what form: the return-gap model, the cost profile and the
expected-value policy. Plain Python, driven by the service and by the simulator alike."""
