"""What the notebooks compute, draw and train; they import these and only display the results."""
