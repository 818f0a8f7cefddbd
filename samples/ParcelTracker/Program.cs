using ParcelTracker;
using ParcelTracker.Hosting;

// dotnet run --project samples/ParcelTracker [-- all|api|consumer|worker|demo] [--postgres "<connection string>" --rabbitmq "amqp://…"]
string role = args.Length > 0 && !args[0].StartsWith('-') ? args[0].ToLowerInvariant() : "all";
string[] rest = args.Length > 0 && !args[0].StartsWith('-') ? args[1..] : args;
if (role == "demo")
{
    return await Demo.RunAsync(rest);
}

Roles roles = role switch
{
    "all" => Roles.All,
    "api" => Roles.Api,
    "consumer" => Roles.Consumer,
    "worker" => Roles.Worker,
    _ => Roles.None,
};
if (roles == Roles.None)
{
    Console.Error.WriteLine($"Unknown role '{role}'. Use one of: all (default), api, consumer, worker, demo.");
    return 2;
}

var app = ParcelTrackerApp.Build(roles, rest);
await app.RunAsync();
return 0;
