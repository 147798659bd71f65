"""The plumbing every flow run stands on: its parameters and record, where its stages' units run, waiting on
them, per-step credentials, one signal that stops it all."""
