"""Simulators and models, each validated against a closed form or a real run."""
