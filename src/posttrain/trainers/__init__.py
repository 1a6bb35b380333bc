"""Trainers: they alone log, checkpoint and step optimisers (and, later, talk to
``torch.distributed``). :mod:`.loop` is the one run loop; :mod:`.offline` holds SFT, the
reward model and DPO as jobs of it; :mod:`.online` the on-policy trainer."""
