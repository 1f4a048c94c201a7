"""The instructor side of Attention Lab: building the student release and grading with nbgrader."""
