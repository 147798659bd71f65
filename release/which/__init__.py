"""``kiln which``: which wheel of a project fits one environment, the environment asked about, and the index read."""
