"""What test modules share: test recipes (named by `recipe._target_=tests.support.<module>.<Recipe>`), readers,
simulated CPUs, reference loops, helpers that start runs. A test module imports shared helpers from here, never
from another test module."""
