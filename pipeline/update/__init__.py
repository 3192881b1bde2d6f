"""The policy update (stage 4): the DeepSpeed trainer (trainer), its training rows (data), and
publishing policy k+1 with its manifest (publish)."""
