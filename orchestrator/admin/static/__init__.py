"""The admin page's static files (HTML and script), served by orchestrator.admin.routes."""
