"""The test stage: isolated test running, classification, reports, distributed helpers."""
