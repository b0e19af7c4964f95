from django.urls import path

from workers import api

urlpatterns = [
    path("replays/", api.ReplayListView.as_view(), name="replay-list"),
    path("replays/<int:pk>/", api.ReplayDetailView.as_view(), name="replay-detail"),
    path("replays/<int:pk>/cancel/", api.ReplayCancelView.as_view(), name="replay-cancel"),
]
