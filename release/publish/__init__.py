"""The publish protocol: what a publish will do, the dependency closure it checks, the pages it
writes, and retention."""
