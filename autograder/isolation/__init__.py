"""Student code kept in its box: the bubblewrap sandbox, control groups, and the kernel server
that every grading kernel is forked from."""
