"""Storage by URI: `s3://bucket/prefix` and local paths through one small interface."""
