"""A worker's side: its ModelRunner, its cache's calls, the attention of extends, graphs and decode steps."""
