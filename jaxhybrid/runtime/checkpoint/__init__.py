"""Per-rank atomic checkpoints (:mod:`.store`) and single-device export (:mod:`.export`)."""
