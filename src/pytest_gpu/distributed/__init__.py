"""Distributed tests on warm pools of rank processes."""
