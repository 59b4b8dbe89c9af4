"""Analyses the chapters run on the models: where parameters, FLOPs and time go."""
