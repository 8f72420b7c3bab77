from django.apps import AppConfig


class TasksAppConfig(AppConfig):
    name = "tasks_app"
    verbose_name = "Tasks"

    def ready(self) -> None:
        """A web process may hold thousands of event streams, a socket each."""
        from .streams import raise_open_file_limit

        raise_open_file_limit()
