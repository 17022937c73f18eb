"""Object storage (fsspec: file://, s3://), checkpoints and model staging."""
