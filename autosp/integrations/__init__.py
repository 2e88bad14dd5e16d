"""autosp inside the training loops people already have (transformers' Trainer, TRL's trainers):
`autosp.integrations.transformers`."""
