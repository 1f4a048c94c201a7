"""What grading gives back: feedback pages, grade exports, the LMS's files and the class report."""
