from django.urls import path

from traces import api

urlpatterns = [
    path("traces/", api.TraceListView.as_view(), name="trace-list"),
    path("traces/<str:ref>/", api.TraceDetailView.as_view(), name="trace-detail"),
]
