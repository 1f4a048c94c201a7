"""What the course keeps: nbgrader's gradebook (SQLite, or a PostgreSQL server), the reading of a
graded notebook, and nbgrader's own command line (which writes the gradebook)."""
