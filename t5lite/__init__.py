"""t5lite: gin-configured JAX training for T5-family and Mixture-of-Experts models."""

__version__ = "0.1.0"
