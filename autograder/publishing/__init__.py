"""What students get: the student notebooks built from ``solutions/`` (and the sources grading
uses), and the students' own repository."""
