"""Trainers: they alone log, checkpoint, step optimisers (and, later, talk to
``torch.distributed``). Each offline trainer is a small subclass of
:class:`posttrain.trainers.base.Trainer`."""
