"""`prfaas up`: every service of a deployment as child processes on one machine."""
