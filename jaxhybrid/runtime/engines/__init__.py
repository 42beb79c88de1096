"""Gradient engines: the seam between the trainer and every parallel layout (:mod:`.base`)."""
