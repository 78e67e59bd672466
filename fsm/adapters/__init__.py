"""Trainer adapters. Each maps the one flat sample form (fsm/output/sample.py) to its trainer's own."""

from fsm.output.sample import Sample, SampleBatch, TurnReward, to_sample, to_samples

__all__ = ["Sample", "SampleBatch", "TurnReward", "to_sample", "to_samples"]
