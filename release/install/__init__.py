"""Installing from an index as a user would: fresh environments, the caller's pip configuration, where
each file comes from, printed hints run."""
