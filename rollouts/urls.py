from django.urls import path

from rollouts import views

app_name = "rollouts"

urlpatterns = [
    path("<slug:key>/", views.timeline, name="timeline"),
]
