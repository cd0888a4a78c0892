"""ampctl: a command-line runner for mixed-precision training experiments in PyTorch."""

__version__ = "0.1.0"
