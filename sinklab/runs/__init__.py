"""What a run dir holds, for the training that writes it and the commands that read it: checkpoints (the kept ones
and last.ckpt) and status.json."""
