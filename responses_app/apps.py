from django.apps import AppConfig


class ResponsesAppConfig(AppConfig):
    name = "responses_app"
    verbose_name = "Responses"

    def ready(self) -> None:
        """Build on the task machinery: a response is a task type, and its record
        follows its task's outcome; a deleted user's words are announced erased."""
        from django.contrib.auth import get_user_model
        from django.db.models.signals import post_delete

        from tasks_app import signals, task_types

        from . import records, submit

        task_types.register("response", submit.submit_task)
        signals.task_finished.connect(records.finish, dispatch_uid="responses.finish")
        signals.task_reopened.connect(records.reopen, dispatch_uid="responses.reopen")
        post_delete.connect(
            records.owner_deleted, sender=get_user_model(), dispatch_uid="responses.owner"
        )
