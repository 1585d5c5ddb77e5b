"""What runs inside training workers: the demo job now; writers and loaders to come."""
