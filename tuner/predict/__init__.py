"""Predicting capacity: an engine's measured step times (tuner.predict.profile) drive a virtual-time simulation of
its scheduler (tuner.predict.simulate) through the real capacity search (tuner.measure.capacity)."""
