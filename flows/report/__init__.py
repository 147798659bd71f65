"""What a run says to the people reading it: the console table, the summary and install hint, progress, flow run
names, the generated reference pages."""
