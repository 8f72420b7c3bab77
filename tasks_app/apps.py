from django.apps import AppConfig


class TasksAppConfig(AppConfig):
    name = "tasks_app"
    verbose_name = "Tasks"

    def ready(self) -> None:
        """A web process may hold thousands of event streams, a socket each;
        a deleted user's tasks stop their workers and streams."""
        from django.contrib.auth import get_user_model
        from django.db.models.signals import pre_delete

        from .lifecycle import owner_deleting
        from .stream_admission import raise_open_file_limit

        raise_open_file_limit()
        pre_delete.connect(owner_deleting, sender=get_user_model(), dispatch_uid="tasks.owner")
